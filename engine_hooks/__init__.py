"""What an engine imports: create and export caches, start the CTMs, submit tasks, the prefix cache."""
