"""Domain specialists vs one generalist, with a router: a stage that trains several runs in
parallel processes and scores the systems (``smollm2_specialists``, docs/systems.md)."""
