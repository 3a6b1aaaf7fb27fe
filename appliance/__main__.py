import sys

from appliance.cli import main

# Guarded: a spawned worker process (the HTTP body decoder's) imports this module again.
if __name__ == "__main__":
    sys.exit(main())
