import os

LIMIT = 10


# Adds one.
def add_one(value):
    return value + 1


class Counter:
    """Counts things."""

    def __init__(self, start):
        self.count = start

    @property
    def doubled(self):
        return self.count * 2

    def bump(self, step=1):
        self.count += step
        return self.count
