"""ssdmoe validate: the matrix of real configurations, its runner and its report (no MLX)."""
