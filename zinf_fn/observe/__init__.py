"""What the engine records about itself: time spans and I/O clocks (``trace``) and what a state's
engine has moved and holds (``counters``)."""
