import sys

from kvferry.decode_worker.worker import main

sys.exit(main())
