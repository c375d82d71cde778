"""Pure-Python scheduling: requests, step plans, the scheduler.

NOTE: nothing here imports torch; tests/test_boundaries.py asserts it.
"""

from ssmserve.scheduler.plan import ScheduledChunk, StepPlan
from ssmserve.scheduler.request import Request, RequestStatus
from ssmserve.scheduler.scheduler import Scheduler

__all__ = ["Request", "RequestStatus", "ScheduledChunk", "StepPlan", "Scheduler"]
