"""The connector's scheduler half: decides per request, never talks to the daemon."""
