"""Memory planned before it is allocated: measured devices (``devices``), bytes per component
(``estimate``; ``compute`` and ``graphalloc`` replay llama.cpp's reserve graphs), the plan with its
levers and reasons (``planner``), the per-request admission check (``guard``) and the one rule for
what a context holds (``context``)."""
