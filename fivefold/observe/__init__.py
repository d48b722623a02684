"""What a run measures and draws: the step tracer (`trace`), model-state and peak memory
(`memory`), the devices' peak FLOP/s (`peak`) and the pictures (`report`)."""
