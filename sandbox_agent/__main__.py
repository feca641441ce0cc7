"""python -m sandbox_agent: see sandbox_agent.cli."""

from sandbox_agent.cli import main

raise SystemExit(main())
