"""Dashboard widgets, one per module. Each renders an EngineView and nothing else."""
