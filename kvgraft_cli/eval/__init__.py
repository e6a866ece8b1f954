"""Problems and answers: reading problem files, extracting and normalizing final answers, scoring with Wilson intervals. Torch-free."""
