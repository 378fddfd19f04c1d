"""``python -m prefill_worker.testing.decode_peer``: the reference decode peer as a process
(``peer_control.main``). A module of its own, so that the peer (this package) never imports
its command line, which imports the peer."""

import sys

from prefill_worker.testing.peer_control import main

sys.exit(main())
