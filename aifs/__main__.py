from aifs.cli import main

raise SystemExit(main())
