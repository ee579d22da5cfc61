import sys

from kvferry.kvpool.node import main

sys.exit(main())
