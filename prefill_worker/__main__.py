import sys

from kvferry.prefill_worker.worker import main

sys.exit(main())
