"""Scale-out: rollout workers on processes or Ray, an inference endpoint pool, the trainer on FSDP2.

Nothing here is imported unless asked for; a single machine needs none of it (see docs/scaling.md).
"""
