"""natsim.cli: the `natsim` command, one module per sub-command (sweep, sim, plan, calibrate, mask).
Each parses its options, calls natsim or natsim.planner, and shows the result as a rich table or JSON;
common.py holds what they share (consoles, errors as one red line, progress), main.py assembles the app.
"""
