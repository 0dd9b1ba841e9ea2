"""The HTTP face: routes, their dependencies and guards, the state the lifespan builds, /status
views and the dashboard's static files. Top room: may import every room below (observability,
building, rollouts, fleet, storage) and config; nothing below imports it."""
