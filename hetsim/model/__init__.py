"""The model of a training step: cost model, memory model and the event simulator."""
