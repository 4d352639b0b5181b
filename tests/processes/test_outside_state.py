"""Class attributes and module globals that ``on_epoch_end`` changes reach worker processes (NOTE [ State
outside the instance ], kerasfeed/execution/outside_state.py), as Keras' own ``use_multiprocessing`` (a pool
forked again every epoch) and threads see them."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import warnings

from _util import wait_until

import kerasfeed
from kerasfeed import ProcessExecutor
from kerasfeed.execution.processes import replacement

TESTS = pathlib.Path(__file__).resolve().parent.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # byo_sources: real module files the workers import

from byo_sources import outside  # noqa: E402


def _passes(source, executor, passes=3, **kwargs):
    with kerasfeed.to_loader(source, executor=executor, **kwargs) as loader:
        got = [[b.tolist() for b in loader] for _ in range(passes)]
        stats = kerasfeed.executor_of(loader).stats() if executor != "threads" else None
    return got, stats


def test_class_attributes_and_module_globals_changed_by_the_hooks_reach_the_workers():
    want, _ = _passes(outside.Leveled(), "threads")
    assert [p[0][1:4] for p in want] == [[0, 0, 1], [1, 10, 2], [2, 20, 4]]
    got, stats = _passes(outside.Leveled(), "processes", workers=2)
    assert got == want
    assert stats["state"]["syncs"] == 2  # one per boundary where something changed
    ds = kerasfeed.to_dataset(outside.Leveled(), executor="processes", workers=2)
    try:
        assert [[b.tolist() for b in ds.as_numpy_iterator()] for _ in range(3)] == want
    finally:
        kerasfeed.executor_of(ds).close()


n = 0  # a module global named like an attribute Still reads (self.n), which it never reads itself


class Still(outside.Leveled):
    def __len__(self):
        return self.n

    def on_epoch_end(self):
        pass


def test_nothing_is_sent_while_nothing_outside_changes():
    global n
    with kerasfeed.to_loader(Still(), executor="processes", workers=2) as loader:
        got = []
        for n in range(3):  # rebinds the module global n every pass
            got.append([b.tolist() for b in loader])
        stats = kerasfeed.executor_of(loader).stats()
    assert got == [[[i, 0, 0, 1, 1] for i in range(4)]] * 3
    assert stats["state"]["syncs"] == 0


def test_a_changed_global_that_cannot_be_pickled_is_named_once_and_the_rest_still_reaches_the_workers():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, _ = _passes(outside.Leveled(lock=True), "processes", workers=2)
    assert [p[0] for p in got] == [[0, 0, 0, 1, 1], [0, 1, 10, 2, 1], [0, 2, 20, 4, 1]]  # LOCK: the workers' False
    named = [str(w.message) for w in caught if "module global byo_sources.outside.LOCK" in str(w.message)]
    assert len(named) == 1, [str(w.message) for w in caught]
    assert "read by Leveled's code, changed in this process but cannot be pickled (TypeError" in named[0]
    assert named[0].endswith("Received: _thread.lock")


def test_a_class_defined_in_main_gets_its_changes_too(tmp_path):
    """A script's class travels by value (cloudpickle), its globals with it: the workers' copies change."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent('''
        import numpy as np
        import keras
        import kerasfeed

        STRENGTH = 0

        class S(keras.utils.Sequence):
            level = 0
            def __len__(self):
                return 2
            def __getitem__(self, i):
                return np.array([i, type(self).level, STRENGTH])
            def on_epoch_end(self):
                global STRENGTH
                type(self).level += 1
                STRENGTH += 10

        if __name__ == "__main__":
            with kerasfeed.to_loader(S(), executor="processes", workers=2) as ld:
                print([[b.tolist() for b in ld] for _ in range(3)])
    '''))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == str(
        [[[0, 0, 0], [1, 0, 0]], [[0, 1, 10], [1, 1, 10]], [[0, 2, 20], [1, 2, 20]]]
    )


def test_a_worker_started_after_a_rebase_gets_what_changed_outside_the_instance():
    """A successor (after a death) starts from the source pickled anew: a class in a module file comes back
    with the module's import-time values unless the rebase carries what changed since the start."""
    src = outside.LeveledTable(n=16)
    ex = ProcessExecutor(src, workers=2, retries=1, seed=0)
    try:
        for epoch in range(4):
            ex.plan(epoch, list(range(src.n)))
            first = ex.load(0, epoch)
            os.kill(int(first[6]), signal.SIGKILL)  # the worker that made it
            assert wait_until(lambda: int(first[6]) not in ex.pids and len(ex.pids) == 2, timeout=20)
            ex.wait_ready(20)
            rows = [first.tolist()] + [ex.load(i, epoch).tolist() for i in range(1, src.n)]
            assert [r[:6] for r in rows] == [[i, epoch, 10 * epoch, 2**epoch, 1, epoch] for i in range(src.n)]
            src.on_epoch_end()
        kept = ex._dispatcher.replacements._states
        assert len(kept) < 4 and kept[0][1] != replacement._NO_CHANGE  # rebased, with the outside values
    finally:
        ex.close()



def test_another_modules_global_read_as_an_attribute_or_through_its_function_reaches_the_workers():
    """``outside_cfg.SCALE``, ``scale()`` imported from it and ``byo_sources.outside_cfg.SCALE``: the workers
    kept 1 (helper's reviews)."""
    got, _ = _passes(outside.Configured(), "processes", workers=2)
    assert [p[1] for p in got] == [[1, 1, 1, 1], [1, 3, 3, 3], [1, 9, 9, 9]]


def test_a_global_each_process_makes_on_first_use_is_not_sent_when_the_consumer_makes_it_too():
    """The consumer ran an item between passes (``seq[0]``): its generator went to every worker, which then drew
    the same numbers (5 of 5 runs). An underscored global made from None is each process's own: not sent."""
    outside._RNG = None
    src = outside.Drawing()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with kerasfeed.to_loader(src, executor="processes", workers=2) as loader:
            passes = []
            for _ in range(3):
                passes.append([b.tolist() for b in loader])
                src[0]  # the consumer makes its own generator
            stats = kerasfeed.executor_of(loader).stats()
    for rows in passes:
        assert len({pid for _, _, pid in rows}) == 2 and len({v for _, v, _ in rows}) == 8
    assert stats["state"]["syncs"] == 0
    assert not [w for w in caught if "kerasfeed" in str(w.message)]  # the usual pattern: nothing to say


def test_a_public_global_set_from_none_to_a_generator_is_not_sent_and_said_once():
    import threading

    import numpy as np

    from kerasfeed.execution import outside_state

    key = ("global", "some_module", "RNG")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert outside_state.lazy(key, None, np.random.default_rng()) and outside_state.lazy(key, None, threading.Lock())
        assert not outside_state.lazy(key, np.random.default_rng(), None)  # turned off: sent
        assert not outside_state.lazy(("global", "some_module", "SCALE"), None, 2.0)  # data: sent
        assert not outside_state.lazy(("global", "some_module", "AUGMENTER"), None, Still())  # a setting: sent
        assert not outside_state.lazy(("global", "some_module", "_ORDER"), None, np.arange(3))
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "module global some_module.RNG was set from None to a random generator" in said[0]


def _module(tmp_path, name, code):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(code))
    sys.path.insert(0, str(tmp_path))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(tmp_path))


def test_the_globals_a_function_reads_come_from_its_source_by_python_s_scope_rules(tmp_path):
    """An attribute or a local named like a module global is not a read of it (``self.epoch`` beside a script's
    loop variable ``epoch``); a global also named by a nested function's parameter, a lambda's or a
    comprehension's variable still is (a review found it lost); a method's unindented string hides nothing."""
    from kerasfeed.execution import outside_state

    code = '''
        import types
        STRENGTH, epoch, count, noise = 2, 0, 1, 1
        class Source:
            def item(self, i):
                def add(x, noise):
                    return x + noise
                count = len(self.names)
                note = """
        at column 0
        """
                shadow = [noise for noise in range(2)]
                return add(STRENGTH * self.epoch * count, noise), types.SimpleNamespace, note, (lambda noise: noise)(1)
    '''
    item = _module(tmp_path, "with_source", code).Source.item
    names = outside_state._names(item)
    assert {name for name, _ in names} == {"STRENGTH", "noise", "types", "len", "range"}
    assert ("types", ("SimpleNamespace",)) in names
    assert sorted(name for _, name in outside_state.read_by([item])) == ["STRENGTH", "noise", "types"]


def test_without_a_source_that_is_the_function_s_every_name_and_module_chain_is_followed(tmp_path):
    """Code run from ``exec`` (a script on stdin) and a module whose file was edited since it was imported
    (``getsource`` would read another function): ``co_names``, through the user's modules (``pkg.cfg.X``)."""
    from kerasfeed.execution import outside_state

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from . import cfg\n")
    (tmp_path / "pkg" / "cfg.py").write_text("X = 1\n")
    code = textwrap.dedent('''
        import pkg
        STRENGTH = 2
        class Source:
            def other(self):
                return 1

            def item(self, i):
                return STRENGTH * pkg.cfg.X + self.epoch
    ''')
    sys.path.insert(0, str(tmp_path))
    try:
        space: dict = {}
        exec(compile(code, "<typed>", "exec"), space)
        names = outside_state._names(space["Source"].item)
        assert {("STRENGTH", ()), ("pkg", ("cfg", "X"))} <= names
        assert ("pkg", ("cfg",)) in names and ("epoch", ()) in names  # more than it reads: a sync too many
        item = _module(tmp_path, "edited", code).Source.item
        assert outside_state._names(item) == {("STRENGTH", ()), ("pkg", ()), ("pkg", ("cfg",)), ("pkg", ("cfg", "X"))}
        (tmp_path / "edited.py").write_text("# three\n# lines\n# added\n" + code)  # item's first line: other's def
        assert {("STRENGTH", ()), ("pkg", ("cfg", "X"))} <= outside_state._names(item)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("pkg", None), sys.modules.pop("pkg.cfg", None)


def test_a_method_with_a_nonlocal_of_the_function_that_made_its_class_falls_back_to_its_names():
    """``symtable`` alone refuses its source (no binding for the nonlocal there): a review's SyntaxError."""
    from kerasfeed.execution import outside_state

    def make():
        calls = 0

        class Counted:
            def item(self, i):
                nonlocal calls
                calls += 1
                return n + i

        return Counted

    assert ("n", ()) in outside_state._names(make().item)
