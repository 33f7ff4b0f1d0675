"""The simulator as a tool: its costs fitted to measured runs (:mod:`.calibrate`) and the
report of a sweep against it (:mod:`.report`, ``aioreduce-bench sim``).

The model itself (every scheme's step graph on an engine of links and CPUs) is part of the
runtime, :mod:`aioreduce.costmodel`, as ``Node(scheme="auto")`` ranks schemes by it; this
package, like :mod:`aioreduce.bench`, is over the library and the library never imports it.
"""
