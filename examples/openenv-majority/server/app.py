"""The majority environment's server (OpenEnv's ``create_app``): ``uvicorn server.app:app``."""

from openenv.core.env_server.http_server import create_app

try:
    from ..models import MajorityAction, MajorityObservation
    from .majority_environment import MajorityEnvironment
except ImportError:
    from models import MajorityAction, MajorityObservation
    from server.majority_environment import MajorityEnvironment

app = create_app(MajorityEnvironment, MajorityAction, MajorityObservation, env_name="majority",
                 max_concurrent_envs=1)


def main(host: str = "0.0.0.0", port: int = 8000):
    import uvicorn

    uvicorn.run(app, host=host, port=port)


if __name__ == "__main__":
    main()
