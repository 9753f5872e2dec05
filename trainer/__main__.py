"""`python -m trainer`.

A stop request that arrives before the trainer's own signal handling (while torch imports,
while the run starts) must still end as one line and exit 75, never a traceback or a bare
death by SIGTERM: until then SIGTERM raises KeyboardInterrupt, as Ctrl-C does, and `main`
turns that into a line. `trainer.errors` is tiny, so it is imported before the handler.
"""

import signal
import sys

from trainer.errors import EXIT_INTERRUPTED

signal.signal(signal.SIGTERM, signal.default_int_handler)
try:
    from trainer.cli import exit_process, main
except KeyboardInterrupt:
    print("trainer: interrupted while starting; nothing was changed", file=sys.stderr)
    sys.exit(EXIT_INTERRUPTED)

exit_process(main())
