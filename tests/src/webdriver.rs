//! A headless Chromium driven over WebDriver (Debian `chromium` + `chromium-driver`, which
//! `.ci/run` installs): just the commands the session-page test needs, spoken as plain JSON
//! over HTTP to a `chromedriver` this process starts on loopback and stops by its PID.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::http_request;

/// The W3C id of an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A running chromedriver with one browser session.
pub struct Browser {
    driver: Child,
    port: u16,
    session: String,
    _profile: tempfile::TempDir,
}

fn path_of(name: &str, fallback: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| fallback.to_owned())
}

impl Browser {
    /// Starts chromedriver and a headless Chromium. A missing browser is a failure that says
    /// how to install it, never a skip.
    pub fn start() -> Browser {
        let driver_bin = path_of("FLOTILLA_CHROMEDRIVER", "/usr/bin/chromedriver");
        let chrome_bin = path_of("FLOTILLA_CHROMIUM", "/usr/bin/chromium");
        assert!(
            Path::new(&driver_bin).exists() && Path::new(&chrome_bin).exists(),
            "Chromium and ChromeDriver are missing ({chrome_bin}, {driver_bin}); install them with `apt-get install chromium chromium-driver` (.ci/run does)"
        );
        let port = crate::cluster::free_port();
        let driver = Command::new(&driver_bin)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let profile = tempfile::tempdir().expect("profile dir");
        // From here on, dropping `b` (a failed assertion included) stops the driver.
        let mut b = Browser {
            driver,
            port,
            session: String::new(),
            _profile: profile,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let up = std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
                && http_request(port, "GET", "/status", &[], None).status == 200;
            if up {
                break;
            }
            assert!(Instant::now() < deadline, "chromedriver never answered");
            std::thread::sleep(Duration::from_millis(100));
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chrome_bin,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1280,1600",
                         format!("--user-data-dir={}", b._profile.path().display())],
            }
        }}});
        let v = b.call("POST", "/session", Some(caps));
        b.session = v["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {v}"))
            .to_owned();
        b
    }

    /// One WebDriver command; its `value`. Errors panic with what the driver said.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        self.try_call(method, path, body)
            .unwrap_or_else(|e| panic!("WebDriver {method} {path}: {e}"))
    }

    /// One WebDriver command; its `value`, or the error the driver gave.
    fn try_call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
        let text = body.map(|b| b.to_string());
        let r = http_request(
            self.port,
            method,
            path,
            &[("Content-Type", "application/json")],
            text.as_deref(),
        );
        let v: Value = serde_json::from_str(&r.body)
            .map_err(|e| format!("chromedriver said {} ({e}): {}", r.status, r.body))?;
        if r.status >= 400 {
            // The message says more (which element would receive a click instead, say); its
            // first line is enough.
            let said = v["value"]["message"].as_str().unwrap_or_default();
            let said = said.lines().next().unwrap_or_default();
            return Err(format!("{} {}: {said}", r.status, v["value"]["error"]));
        }
        Ok(v["value"].clone())
    }

    fn s(&self, rest: &str) -> String {
        format!("/session/{}{rest}", self.session)
    }

    pub fn goto(&self, url: &str) {
        self.call("POST", &self.s("/url"), Some(json!({ "url": url })));
    }

    /// Runs a script in the page and returns its value.
    pub fn eval(&self, script: &str) -> Value {
        self.call(
            "POST",
            &self.s("/execute/sync"),
            Some(json!({"script": script, "args": []})),
        )
    }

    /// The text of the first element matching `css`, if any.
    pub fn text(&self, css: &str) -> Option<String> {
        let v = self.eval(&format!(
            "const e = document.querySelector({}); return e ? e.textContent : null;",
            json!(css)
        ));
        v.as_str().map(str::to_owned)
    }

    /// The WebDriver id of the first element matching `css` (panics when there is none).
    fn find(&self, css: &str) -> String {
        let e = self.call(
            "POST",
            &self.s("/element"),
            Some(json!({"using": "css selector", "value": css})),
        );
        e[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element {css}: {e}"))
            .to_owned()
    }

    /// Clicks the first element matching `css` (a real WebDriver click). The page replaces
    /// its live part as the run goes on, so an element found a moment ago can be gone: find it
    /// again then.
    pub fn click(&self, css: &str) {
        let mut last = String::new();
        for _ in 0..10 {
            let id = self.find(css);
            match self.try_call(
                "POST",
                &self.s(&format!("/element/{id}/click")),
                Some(json!({})),
            ) {
                Ok(_) => return,
                Err(e) if e.contains("stale element") => last = e,
                Err(e) => panic!("click {css}: {e}"),
            }
        }
        panic!("click {css}: the element kept going stale ({last})");
    }

    /// Clicks at point (`x`, `y`) of the viewport (CSS pixels): a real pointer's press and
    /// release there, on whatever is on top.
    pub fn click_at(&self, x: u64, y: u64) {
        self.call(
            "POST",
            &self.s("/actions"),
            Some(json!({"actions": [{"type": "pointer", "id": "mouse",
                "parameters": {"pointerType": "mouse"},
                "actions": [
                    {"type": "pointerMove", "duration": 0, "origin": "viewport", "x": x, "y": y},
                    {"type": "pointerDown", "button": 0},
                    {"type": "pointerUp", "button": 0}]}]})),
        );
    }

    /// Types `text` into the first element matching `css` (a real WebDriver send-keys).
    pub fn type_into(&self, css: &str, text: &str) {
        let id = self.find(css);
        self.call(
            "POST",
            &self.s(&format!("/element/{id}/value")),
            Some(json!({ "text": text })),
        );
    }

    /// The page's address.
    pub fn url(&self) -> String {
        self.call("GET", &self.s("/url"), None)
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// Waits until `check` returns `Some`, polling every 100 ms.
    pub fn wait_for<T>(
        &self,
        what: &str,
        secs: u64,
        mut check: impl FnMut(&Browser) -> Option<T>,
    ) -> T {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(v) = check(self) {
                return v;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Saves a PNG screenshot of the page.
    pub fn screenshot(&self, to: &Path) {
        let v = self.call("GET", &self.s("/screenshot"), None);
        use base64::Engine;
        let png = base64::engine::general_purpose::STANDARD
            .decode(v.as_str().expect("base64 screenshot"))
            .expect("a base64 PNG");
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).expect("artifact dir");
        }
        std::fs::write(to, png).expect("write screenshot");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = http_request(self.port, "DELETE", &self.s(""), &[], None);
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}
