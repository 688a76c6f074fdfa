"""What leaves the agent: Prometheus exposition, and later alert push and job reports."""
