"""Known, harmless third-party chatter kept off the terminal of composer-serve, composer-train and
`python -m serve.tiny`: torchao's failed loads of its CUDA extensions (on a CPU machine, or another GPU
generation) and torch's deprecation notices about torchao's pytree registrations, both printed when
transformers imports torchao. Only those loggers are raised to ERROR; every other warning still shows.
(index/quiet.py sends the index extra's chatter to a log file instead: the index imports nothing of ours.)
"""

from __future__ import annotations

import logging

NOISY = ("torchao", "torch.utils._pytree")


def hush() -> None:
    """Call before the first import of transformers or torchao."""
    for name in NOISY:
        logging.getLogger(name).setLevel(logging.ERROR)
