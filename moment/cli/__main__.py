from moment.cli import main

raise SystemExit(main())
