"""Tests of engine/serve/: the HTTP server against a real `engine serve`."""
