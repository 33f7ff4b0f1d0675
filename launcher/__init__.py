"""aioreduce-launch: start the ranks of a job, tag their output, tear everything down on failure.

Installed as the ``aioreduce_launch`` package (the repository folder is ``launcher/``).
"""

__all__: list[str] = []
