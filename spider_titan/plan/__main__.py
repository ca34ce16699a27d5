"""``python -m spider_titan.plan``."""

import sys

from spider_titan.plan.cli import main

sys.exit(main())
