"""MoE token dispatchers: allreduce (no dispatch communication), all_to_all (token exchange)."""
