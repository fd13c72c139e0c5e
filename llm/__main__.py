import sys

from llm.commands import main

sys.exit(main())
