"""MoE token dispatchers: allreduce (no dispatch communication)."""
