"""The plan as data, shared by the planner and both runtimes: which operations run where, the schedules,
the ranks' layout and the settings of a pipeline; printed as a table and simulated as a timeline.
"""
