"""Composer's coding agent: the loop, the model client, the tools and the front-ends.

Kept light on purpose: importing `agent` pulls in neither torch nor the serving or training stacks.
"""

__version__ = "0.1.0"
