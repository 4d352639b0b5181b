"""The marker Keras' own conftest.py registers for its tests (every backend kerasfeed runs on trains)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_trainable_backend: mark test for trainable backend only")
