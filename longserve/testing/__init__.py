"""Development helpers shared by the tests and scripts/dev (tiny random checkpoints); the engine never imports
this package."""
