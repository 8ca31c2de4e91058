"""execrt core: runtime objects, backend interfaces, plugins and config (torch + stdlib only)."""
