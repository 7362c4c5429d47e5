"""End-to-end examples of hetsim: search a plan, then train with it."""
