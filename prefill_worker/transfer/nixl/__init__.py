"""NIXL plumbing both protocols use: the agent and its registrations (``agent``), posting
writes where the agent lives (``poster``, ``push_thread``), one sender's writes (``writes``)
and writes or statuses waiting for writes to settle (``reaper``). Imports NIXL lazily.
"""
