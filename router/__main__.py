import sys

from kvferry.router.server import main

sys.exit(main())
