"""What the service keeps between requests: translated files, suggestions, rate-limit counters
(in memory, SQLite or Redis)."""
