"""Front-end-neutral assembly: the pass pipeline that to_dataset (and other front ends) drive."""
