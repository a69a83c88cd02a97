"""The three processes: frontend, conductor, worker."""
