"""The trajectory plane: assembles steps and outcomes into trajectories, stores them in
ClickHouse, serves them over HTTP and streams completed groups to trainers."""
