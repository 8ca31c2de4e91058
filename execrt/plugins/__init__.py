"""Plugins shipped with execrt."""
