"""Pipeline parallelism: schedules as data, the one executor, bubble replay, zero-bubble B/W."""
