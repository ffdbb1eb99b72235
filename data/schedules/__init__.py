"""Delay schedules: the protocol with FixedDelay and Sync, the virtual clock, and Live."""
