"""Data side of lit_gmc: prompt streams, rollout engines, delay schedules, tasks and the DataModule."""
