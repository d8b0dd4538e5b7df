"""The lockstep: one engine thread that advances every live session of a device by one frame
per tick (``scheduler.py``), the decision of when to tick as a pure function
(``tick_policy.py``) and the watchdog that notices a tick that never returns
(``watchdog.py``).  Runs in the engine process (or, in the thread layout, in the worker).
"""
