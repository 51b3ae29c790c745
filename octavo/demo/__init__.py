"""`octavo demo`: the seed's ten requests run for real, drawn from the engine's trace rows."""
