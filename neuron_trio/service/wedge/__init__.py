"""The wedge path: the watchdog (step deadline, abort, recovery), the deadman (exit 70) and the forensics report it writes."""
