"""SSM state slots: one per running request, shared by every SSM layer. Pure Python."""

from __future__ import annotations


class StatePool:
    """A free list of `num_slots` state-slot ids.

    Every SSM layer holds conv and SSM state tensors of `num_slots` rows; a request owns
    the same row in all of them from admission until it ends or is preempted.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        # Lowest slot first, so a lone request always runs in slot 0 (reproducible).
        self._free: list[int] = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)
        self._free.sort(reverse=True)
