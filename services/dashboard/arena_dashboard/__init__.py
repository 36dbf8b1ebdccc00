"""The web dashboard: a static single-page app, its ``/api`` over the trajectory API, and live
NATS events pushed to browsers as Server-Sent Events. docs/dashboard.md."""
