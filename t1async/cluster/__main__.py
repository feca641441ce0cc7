import sys

from t1async.cluster.cli import main

sys.exit(main())
